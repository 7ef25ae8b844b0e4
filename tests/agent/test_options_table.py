"""The options objects (agent/options.py, decisions D61): one default and one check per option,
one name in every front end, and nothing below the front ends reading the environment for an
option. The source checks read the tree (``ast``): a second copy of a default, or a new
``os.environ`` read in agent/run, agent/mech or agent/snapshot, fails them."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from cuinterpose.agent import options as O
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.snapshot import pb

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = (ROOT / "agent", ROOT / "coordinator")


def _py_files(*dirs):
    for d in dirs:
        yield from sorted(p for p in d.rglob("*.py") if "_proto" not in p.parts)


def _spellings(name: str) -> tuple:
    """How a source may spell option ``name``: carrier_timeout_s, carrier-timeout-s,
    carrierTimeoutS (the config's key; compared in lower case, CARRIER_TIMEOUT_S too)."""
    parts = name.split("_")
    camel = parts[0] + "".join(p.title() for p in parts[1:])
    return (name, name.replace("_", "-"), camel.lower())


def _parents(tree):
    out = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            out[child] = node
    return out


def _arg_of_default(args: ast.arguments, const) -> str:
    pos = [*args.posonlyargs, *args.args]
    for a, d in zip(pos[len(pos) - len(args.defaults) :], args.defaults):
        if d is const:
            return a.arg
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        if d is const:
            return a.arg
    return ""


def default_sites(name: str, value) -> list[str]:
    """``file:line`` of every constant equal to ``value`` (same type) in agent/ and
    coordinator/ whose innermost call or statement, or whose parameter, names option
    ``name``: each place that writes the option's default down."""
    names = _spellings(name)
    out = []
    for path in _py_files(*SOURCES):
        src = path.read_text()
        tree = ast.parse(src)
        parents = _parents(tree)
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Constant)
                and type(node.value) is type(value)
                and node.value == value
            ):
                continue
            units, up = [], parents.get(node)
            while up is not None:
                if isinstance(up, ast.arguments):
                    units.append(_arg_of_default(up, node))
                    break
                if isinstance(up, ast.Call) and len(units) == 0:
                    units.append(ast.get_source_segment(src, up) or "")
                if isinstance(up, ast.stmt):
                    if not isinstance(up, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                        units.append(ast.get_source_segment(src, up) or "")
                    break
                up = parents.get(up)
            if any(s in u.lower() for u in units for s in names):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return sorted(out)


def _defaults():
    """(option, default) of every numeric default (a word such as "auto" is also a value the
    option takes, compared with in the code: not a copy of its default)."""
    seen = set()
    for cls in (O.CheckpointOptions, O.RestoreOptions, O.InspectOptions):
        for f in dataclasses.fields(cls):
            if type(f.default) in (int, float) and f.default:
                seen.add((f.name, f.default))
    return sorted(seen)


@pytest.mark.parametrize("name,value", _defaults(), ids=[f"{n}={v}" for n, v in _defaults()])
def test_every_default_is_written_down_once(name, value):
    """``carrier_timeout_s``'s 3600 (and every other default) is defined in one place: the
    options module (or, for the coordinator's own library default, its protocol module,
    which agent/options.py takes it from); the CLI, the daemon, the config, the run classes,
    the recovery paths and the coordinator refer to that one."""
    sites = default_sites(name, value)
    assert len(sites) == 1, f"{name}'s default {value!r} is written at {sites}"
    assert sites[0].split(":")[0] in (
        "agent/options.py",
        "coordinator/protocol/carriers.py",
        "coordinator/protocol/codes.py",
    ), sites


def test_the_source_check_finds_a_second_copy(tmp_path, monkeypatch):
    """The check above is not vacuous: a copy of carrier_timeout_s's default as a keyword, a
    parameter default, a click option or an ``or`` fallback is each found."""
    d = tmp_path / "agent"
    d.mkdir()
    (d / "copy.py").write_text(
        "import click\n"
        "def f(x, carrier_timeout_s: float = 3600.0):\n"
        "    return g(carrier_timeout_s=3600.0) or float(r.get('carrier_timeout_s') or 3600.0)\n"
        "opt = click.option('--carrier-timeout-s', type=float,\n    default=3600.0)\n"
        "other = dict(timeout_s=3600.0)\n"
    )
    monkeypatch.setattr(f"{__name__}.SOURCES", (d,))
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert default_sites("carrier_timeout_s", 3600.0) == [
        "agent/copy.py:2",
        "agent/copy.py:3",
        "agent/copy.py:3",
        "agent/copy.py:5",
    ]


# -- nothing below the front ends reads the environment for an option ------------------------
#: every read of the process environment in agent/run, agent/mech and agent/snapshot, by
#: (module, function), with why it is not an option of a run
ENVIRON_ALLOWED = {
    ("agent/run/steps.py", "strip_preload_env"): "removes LD_PRELOAD: the agent never runs "
    "under the shim, nor do its helpers",
    ("agent/run/steps.py", "helper_env"): "builds a helper's environment (ours less LD_PRELOAD)",
    ("agent/mech/signal_at.py", "_entries"): "the test trigger CUINTERPOSE_TEST_SIGNAL_AT",
    ("agent/mech/signal_at.py", "signal_point"): "the test trigger CUINTERPOSE_TEST_SIGNAL_AT",
    ("agent/mech/native_cli.py", "find"): "where the cuda-checkpoint utility is installed "
    "(CUINTERPOSE_CUDA_CHECKPOINT), as $PATH is: the installation, not a run's setting",
    ("agent/mech/native_cli.py", "_env"): "builds the utility's environment",
    ("agent/mech/criu_binary.py", "env"): "builds CRIU's environment",
    ("agent/mech/criu_binary.py", "install"): "builds the installer's environment",
    ("agent/mech/criu_binary.py", "cache_dir"): "where CRIU is installed "
    "(CUINTERPOSE_CRIU_CACHE): the installation",
    ("agent/mech/criu_binary.py", "install_hint"): "the OS release file a test stands in for",
    ("agent/mech/criu_binary.py", "_candidates"): "which CRIU binary (CUINTERPOSE_CRIU): the "
    "installation",
    ("agent/mech/criu_run.py", "kept_logs_dir"): "where the logs of failed CRIU runs are kept "
    "(CUINTERPOSE_CRIU_LOG_DIR): the node's diagnostics, not a setting of the run",
    ("agent/snapshot/trust.py", "key_file"): "the node's key (serve --manifest-key, "
    "CUINTERPOSE_MANIFEST_KEY_FILE): the node's identity, set once per process",
    ("agent/snapshot/pb.py", "<module>"): "gRPC's own fork-handler setting, before grpc loads",
    ("agent/snapshot/backends/awsconf.py", "resolve"): "the AWS settings chain (AWS_* "
    "variables and files), read as every AWS client reads it; not yet a run's option",
}


def environ_reads() -> set:
    """(module, function) of every ``os.environ`` / ``os.getenv`` in agent/run, agent/mech
    and agent/snapshot."""
    out = set()
    for path in _py_files(
        ROOT / "agent" / "run", ROOT / "agent" / "mech", ROOT / "agent" / "snapshot"
    ):
        tree = ast.parse(path.read_text())
        parents = _parents(tree)
        for node in ast.walk(tree):
            hit = (
                isinstance(node, ast.Attribute)
                and node.attr in ("environ", "getenv", "environb")
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
            )
            if not hit:
                continue
            fn, up = "<module>", parents.get(node)
            while up is not None:
                if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    fn = up.name
                    break
                up = parents.get(up)
            out.add((str(path.relative_to(ROOT)), fn))
    return out


def test_nothing_below_the_front_ends_reads_the_environment_for_an_option():
    """The run, mech and snapshot layers take every option from the options object; the only
    reads of the environment left there are the allow-listed ones, none an option (and the
    list holds no stale entry)."""
    found = environ_reads()
    assert found - set(ENVIRON_ALLOWED) == set(), "new environment reads below the front ends"
    assert set(ENVIRON_ALLOWED) - found == set(), "stale entries in ENVIRON_ALLOWED"


# -- the table --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(O.BY_KIND))
def test_every_option_has_its_field_in_the_proto_message(kind):
    """Adding an option is its field in agent/options.py and the field of the same name in
    agent.proto's message (checked here): an ``optional`` one of the same type."""
    apb, _, _ = pb.modules()
    cls = O.BY_KIND[kind]
    desc = getattr(apb, cls.__name__).DESCRIPTOR
    fd = desc.fields_by_name
    assert sorted(fd) == sorted(cls.names())
    py = {"bytes": int, "count": int, "ms": int, "seconds": float, "flag": bool}
    for n in cls.names():
        assert fd[n].has_presence, f"{cls.__name__}.{n} must be optional"
        sp = cls.spec(n)
        want = py.get(sp.kind, str)
        got = {
            fd[n].TYPE_DOUBLE: float,
            fd[n].TYPE_INT64: int,
            fd[n].TYPE_INT32: int,
            fd[n].TYPE_BOOL: bool,
            fd[n].TYPE_STRING: str,
        }[fd[n].type]
        assert got is want, n


def test_a_request_sets_only_what_it_names_and_each_bad_field_is_named():
    apb, _, _ = pb.modules()
    own = O.CheckpointOptions(driver="fake", writers=8, incremental=True)
    msg = O.CheckpointOptions.to_proto(
        {"carrier_timeout_s": 90.0, "incremental": False, "gpu_storage": None},
        apb.CheckpointOptions(),
    )
    assert [f.name for f, _ in msg.ListFields()] == ["carrier_timeout_s", "incremental"]
    o = O.CheckpointOptions.from_proto(msg, own)
    assert (o.driver, o.writers, o.carrier_timeout_s, o.incremental) == ("fake", 8, 90.0, False)
    assert O.CheckpointOptions.from_proto(None, own) == own
    with pytest.raises(AgentError) as e:
        O.RestoreOptions.from_proto(apb.RestoreOptions(driver="cuda"))
    assert (e.value.phase, e.value.outcome, e.value.reason) == (
        "request",
        "refused",
        "options.driver='cuda': must be one of \"\", real, fake",
    )


def test_the_environment_is_read_once_and_flags_win():
    env = {
        "CUINTERPOSE_DRIVER": "fake",
        "CUINTERPOSE_GPU_STORAGE": "host",
        "CUINTERPOSE_INCREMENTAL": "1",
        "CUINTERPOSE_CHUNK_BYTES": "1MiB",
        "CUINTERPOSE_WRITERS": "2",
        "CUINTERPOSE_CONTROL_DIR": "/run/cui",
        "CUINTERPOSE_CRIU_TIMEOUT_S": "120",
    }
    o = O.CheckpointOptions.from_environ(env, {"writers": 3, "gpu_storage": None})
    assert (
        o.driver,
        o.gpu_storage,
        o.incremental,
        o.chunk_bytes,
        o.writers,
        o.control_dir,
        o.criu_timeout_s,
    ) == ("fake", "host", True, 1 << 20, 3, "/run/cui", 120.0)
    r = O.RestoreOptions.from_environ(env)
    assert (r.driver, r.criu_timeout_s) == ("fake", 120.0)
    # a flag's error names the flag, a variable's the variable
    with pytest.raises(AgentError) as e:
        O.CheckpointOptions.from_environ({}, {"writers": 0}, label=lambda n: f"--{n}")
    assert e.value.reason == "--writers=0: must be an integer from 1 to 64"
    with pytest.raises(AgentError) as e:
        O.CheckpointOptions.from_environ({"CUINTERPOSE_CHUNK_BYTES": "3MiB"})
    assert e.value.reason == (
        "$CUINTERPOSE_CHUNK_BYTES 3145728 must be a power of two from 65536 to 1073741824 "
        "bytes (64 KiB to 1 GiB)"
    )


def test_the_objects_are_frozen_and_checked_on_every_change():
    o = O.CheckpointOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.carrier_timeout_s = 1.0  # type: ignore[misc]
    assert o.replace(carrier_timeout_s=5).carrier_timeout_s == 5
    with pytest.raises(AgentError) as e:
        o.replace(gpu_storage="disk")
    assert e.value.reason == "gpu_storage='disk': must be one of auto, custom, host"
    with pytest.raises(TypeError):
        O.CheckpointOptions(no_such_option=1)  # type: ignore[call-arg]
