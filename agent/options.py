"""The options of a checkpoint, a restore and an inspect: :class:`CheckpointOptions`,
:class:`RestoreOptions` and :class:`InspectOptions`, frozen dataclasses holding every option
once, with its one default and its one check (docs/agent.md "Options"; decisions D61).

Each field is one option under one name everywhere: the field (``carrier_timeout_s``), the
command line's flag (``--carrier-timeout-s``, agent/cli/common.py ``option_flags``), the field of
the same name in ``cuinterpose.v1.CheckpointOptions``/``RestoreOptions`` (agent.proto), and a
pod's annotation ``cuinterpose.io/checkpoint-carrier-timeout-s`` /
``cuinterpose.io/restore-carrier-timeout-s`` (agent/kube/annotations.py). Its :class:`Spec`
(the field's metadata) says what values it takes and, for some, the environment variable that
sets it. The environment is read here only, by :meth:`Options.from_environ`, which the front
ends (the CLI, ``serve``, the pod watcher) call once; nothing below them reads it for an option.

Adding an option: a field here (``_opt``: default, kind, help, environment variable) and a field
of the same name in agent.proto's message. The flag and the annotation follow from the field.

Errors: :class:`OptionError`, an ``AgentError`` phase "request" (outcome ``refused``, exit 3)
naming the option as its source spells it (``carrier_timeout_s``, ``$CUINTERPOSE_CRIU_TIMEOUT_S``,
``annotation cuinterpose.io/...``, ``options.writers``) and the value, raised before anything
of a run happens.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Mapping, Optional, TypeVar

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.units import parse_bytes
from cuinterpose.coordinator.protocol import (
    CHUNK_CHECKSUMS,
    CUI_DEFAULT_CONTROL_DIR,
    DEFAULT_CARRIER_TIMEOUT_S,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_STAGING_BYTES,
    DEFAULT_WRITERS,
    ChunkSettings,
)

__all__ = [
    "BY_KIND",
    "CheckpointOptions",
    "DriverOptions",
    "InspectOptions",
    "OptionError",
    "Options",
    "RestoreOptions",
    "RunOptions",
    "Spec",
    "annotated_fields",
    "for_kinds",
    "given_of",
    "spec",
]

#: the longest timeout an option may hold, in seconds (one day)
MAX_TIMEOUT_S = 86400.0
#: the driver kinds (``--driver``): the NVIDIA driver, or fakecuda (docs/fakecuda.md)
DRIVERS = ("real", "fake")
#: the native backends (``--native-backend``; agent/mech/native.py)
NATIVE_BACKENDS = ("auto", "driver-api", "cuda-checkpoint")
#: where a native checkpoint puts GPU memory (``--gpu-storage``; agent/run/gpustore_step.py)
GPU_STORAGE_MODES = ("auto", "custom", "host")
#: the texts a flag option reads from the environment or an annotation
TRUE, FALSE = ("1", "true"), ("0", "false", "")


class OptionError(AgentError):
    """A bad option: phase "request", outcome ``refused``. ``option`` is the field name,
    ``label`` how its source spells it, ``value`` what was given, ``why`` what is wrong."""

    def __init__(self, option: str, value, why: str, label: Optional[str] = None):
        self.option, self.value, self.why = option, value, why
        self.label = label or option
        super().__init__("request", f"{self.label}={value!r}: {why}")


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one option takes. ``kind``: ``seconds`` (a float in (0, 86400]), ``ms`` (an
    integer of milliseconds in [``lo``, 86400000]), ``bytes`` (a byte count, ``parse_bytes``;
    None: the writer's default), ``count`` (an integer in [``lo``, ``hi``]; None: the
    default), ``flag`` (a bool), ``choice`` (one of ``choices``; None where the default is
    None), ``path`` (a directory; None where ``optional``). ``env``: the environment
    variable :meth:`Options.from_environ` reads ("" none). ``pod``: a pod annotation may set
    it (False: a setting of the node, the agent's config). ``help``: one sentence for ``--help`` and the docs."""

    kind: str
    help: str
    env: str = ""
    choices: tuple = ()
    lo: int = 1
    hi: int = 0
    pod: bool = True
    optional: bool = False


def _opt(default, kind: str, help: str, **kw):
    return dataclasses.field(default=default, metadata={"spec": Spec(kind, help, **kw)})


def spec(cls, name: str) -> Spec:
    """The :class:`Spec` of option ``name`` of ``cls``."""
    return {f.name: f.metadata["spec"] for f in dataclasses.fields(cls)}[name]


def _why(sp: Spec, v) -> Optional[str]:
    """What is wrong with the typed value ``v`` of an option of ``sp`` (None: nothing)."""
    k = sp.kind
    if k == "seconds":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return "must be a number of seconds"
        if not (math.isfinite(v) and 0 < v <= MAX_TIMEOUT_S):
            return f"must be a finite number of seconds above 0 and at most {MAX_TIMEOUT_S:g}"
    elif k in ("ms", "count"):
        if v is None and k == "count":
            return None
        hi = int(MAX_TIMEOUT_S * 1000) if k == "ms" else sp.hi
        if isinstance(v, bool) or not isinstance(v, int) or not sp.lo <= v <= hi:
            unit = " (milliseconds)" if k == "ms" else ""
            zero = "; 0 = the driver-call deadline" if k == "ms" and sp.lo == 0 else ""
            return f"must be an integer from {sp.lo} to {hi}{unit}{zero}"
    elif k == "bytes":
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            return "must be a positive number of bytes"
    elif k == "flag":
        if not isinstance(v, bool):
            return "must be true or false"
    elif k == "choice":
        if v not in sp.choices:
            shown = [c if c else '""' for c in sp.choices if c is not None]
            return "must be one of " + ", ".join(shown)
    elif k == "path":
        if v is None and sp.optional:
            return None
        if not isinstance(v, str) or not v or "\0" in v:
            return "must be a directory path"
        b = os.fsencode(os.path.abspath(v))
        if len(b) >= 4096 or any(len(p) > 255 for p in b.split(b"/")):
            return "is longer than PATH_MAX (4095 bytes) or has a component over NAME_MAX (255)"
    return None


def _parse(sp: Spec, text: str):
    """The typed value of option text (an environment variable, an annotation); raises
    ValueError with what is accepted."""
    t = text.strip()
    if sp.kind == "seconds":
        try:
            return float(t)
        except ValueError:
            raise ValueError("must be a number of seconds") from None
    if sp.kind in ("ms", "count"):
        try:
            return int(t)
        except ValueError:
            raise ValueError("must be an integer") from None
    if sp.kind == "bytes":
        return parse_bytes(t)
    if sp.kind == "flag":
        if t.lower() in TRUE:
            return True
        if t.lower() in FALSE:
            return False
        raise ValueError("must be 1 or true, 0 or false")
    if sp.kind == "choice":
        return t.lower()
    return t


_O = TypeVar("_O", bound="Options")


@dataclasses.dataclass(frozen=True)
class Options:
    """The base of every options class: construction checks every field (:class:`OptionError`
    naming the first bad one), and the constructors of the front ends."""

    def __post_init__(self):
        for f in dataclasses.fields(self):  # a path may be given as a PathLike: kept as str
            v = getattr(self, f.name)
            if f.metadata["spec"].kind == "path" and isinstance(v, os.PathLike):
                object.__setattr__(self, f.name, os.fspath(v))
        self._check({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, {})

    @classmethod
    def _check(cls, values: dict, labels: dict) -> None:
        """Check ``values`` (every field) one by one, then together; ``labels``: how the
        source spells a field (default its name)."""
        for f in dataclasses.fields(cls):
            why = _why(f.metadata["spec"], values[f.name])
            if why:
                raise OptionError(f.name, values[f.name], why, labels.get(f.name))
        cls._check_together(values, labels)

    @classmethod
    def _check_together(cls, values: dict, labels: dict) -> None:
        """Checks of several fields at once (a subclass's)."""

    def replace(self: _O, **values) -> _O:
        """A copy with ``values`` (field names) changed, checked."""
        return dataclasses.replace(self, **values)

    @classmethod
    def names(cls) -> tuple:
        """The option names (fields) of ``cls``, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def spec(cls, name: str) -> Spec:
        """The :class:`Spec` of option ``name``."""
        return spec(cls, name)

    @classmethod
    def check_one(cls, name: str, value, label: Optional[str] = None) -> None:
        """Check the one option ``name`` = ``value`` on its own (not against the others).
        Raises :class:`OptionError` naming ``label`` (default the name)."""
        if name not in cls.names():
            raise OptionError(name, value, "is not an option", label)
        why = _why(spec(cls, name), value)
        if why:
            raise OptionError(name, value, why, label)

    @classmethod
    def build(cls: type[_O], base: Optional[_O] = None, values=None, labels=None) -> _O:
        """``base`` (default: the defaults) with ``values`` (field name -> typed value) set,
        checked with the errors naming each field as ``labels`` spells it."""
        values, labels = dict(values or {}), dict(labels or {})
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            u = unknown[0]
            raise OptionError(u, values[u], "is not an option", labels.get(u))
        base = base if base is not None else cls()
        values = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in values.items()}
        merged = {n: getattr(base, n) for n in cls.names()} | values
        cls._check(merged, labels)
        return cls(**merged)

    @classmethod
    def parse_text(cls, name: str, text: str, label: str):
        """The typed value of option ``name`` given as ``text`` by a source spelled ``label``
        (an environment variable, an annotation). Raises :class:`OptionError`."""
        sp = spec(cls, name)
        try:
            v = _parse(sp, text)
        except ValueError as e:
            raise OptionError(name, text, str(e), label) from None
        why = _why(sp, v)
        if why:
            raise OptionError(name, text, why, label)
        return v

    @classmethod
    def from_environ(
        cls: type[_O],
        environ: Optional[Mapping[str, str]] = None,
        given=None,
        label: Optional[Callable[[str], str]] = None,
    ) -> _O:
        """The options from ``environ`` (default ``os.environ``): each set (non-empty)
        variable of a :class:`Spec` ``env``; then ``given`` (field name -> typed value: flags,
        a config) wins. The one place an option is read from the environment. Raises
        :class:`OptionError` naming the variable (``$NAME``) and its text, or a value of
        ``given`` as ``label(name)`` spells it (default the name)."""
        env = os.environ if environ is None else environ
        values, labels = {}, {n: label(n) for n in cls.names()} if label else {}
        for f in dataclasses.fields(cls):
            var = f.metadata["spec"].env
            if var and env.get(var, "") != "":
                labels[f.name] = f"${var}"
                values[f.name] = cls.parse_text(f.name, env[var], f"${var}")
        for k, v in (given or {}).items():
            if v is not None:
                values[k] = v
                labels[k] = label(k) if label else k
        return cls.build(None, values, labels)

    @classmethod
    def from_proto(cls: type[_O], msg, base: Optional[_O] = None, prefix: str = "options.") -> _O:
        """``base`` (the daemon's options) with every field ``msg`` (the agent.proto message of
        the same fields) sets; errors name ``options.FIELD``."""
        values, labels = {}, {}
        for n in cls.names():
            if msg is not None and msg.HasField(n):
                v = getattr(msg, n)
                values[n], labels[n] = (v if not isinstance(v, str) else v.strip()), prefix + n
        return cls.build(base, values, labels)

    @classmethod
    def to_proto(cls, given: Mapping[str, Any], msg) -> Any:
        """Set on ``msg`` (the message of the same fields) each option of ``given`` that is not
        None; returns ``msg``. A request carries only what its sender chose: the daemon's own
        options apply to the rest."""
        for k, v in given.items():
            if v is not None and k in cls.names():
                setattr(msg, k, v)
        return msg


@dataclasses.dataclass(frozen=True)
class DriverOptions(Options):
    """The options of every command that talks to the driver (checkpoint, restore, inspect,
    release, doctor)."""

    driver: str = _opt(
        "",
        "choice",
        "libcuda.so.1 to load: real (the NVIDIA driver) or fake (fakecuda) [default: "
        "$CUINTERPOSE_DRIVER, else real; a restore: the driver its manifest records].",
        env="CUINTERPOSE_DRIVER",
        choices=("", *DRIVERS),
        pod=False,
    )
    native_backend: str = _opt(
        "auto",
        "choice",
        "how the native checkpoint is driven: the driver API (cuCheckpointProcess*), the "
        "cuda-checkpoint utility, or auto (the API when libcuda.so.1 has it, else a "
        "cuda-checkpoint found) [default: $CUINTERPOSE_NATIVE_BACKEND, else auto].",
        env="CUINTERPOSE_NATIVE_BACKEND",
        choices=NATIVE_BACKENDS,
        pod=False,
    )
    driver_call_timeout_s: float = _opt(
        60.0,
        "seconds",
        "deadline of one driver call about another process (a lock: its own timeout plus "
        "this) [default: 60, or $CUINTERPOSE_DRIVER_CALL_TIMEOUT_S].",
        env="CUINTERPOSE_DRIVER_CALL_TIMEOUT_S",
    )


def _control_dir():
    """The ``control_dir`` option (a field of each class that has it)."""
    return _opt(
        CUI_DEFAULT_CONTROL_DIR,
        "path",
        "the shims' control directory, the workload's [default: $CUINTERPOSE_CONTROL_DIR, "
        f"else {CUI_DEFAULT_CONTROL_DIR}].",
        env="CUINTERPOSE_CONTROL_DIR",
        pod=False,
    )


@dataclasses.dataclass(frozen=True)
class InspectOptions(DriverOptions):
    """The options of ``inspect`` (agent/inspect.py): the driver's, to ask it the process's
    checkpoint state, the control directory and INSPECT's deadline."""

    control_dir: str = _control_dir()
    phase_timeout_s: float = _opt(10.0, "seconds", "deadline of the INSPECT request [default: 10].")


@dataclasses.dataclass(frozen=True)
class RunOptions(DriverOptions):
    """The options a checkpoint and a restore share."""

    phase_timeout_s: float = _opt(
        60.0,
        "seconds",
        "deadline of each coordinator request (INSPECT, PREPARE_UNICAST, RESTORE_UNICAST, ...) "
        "[default: 60].",
    )
    carrier_timeout_s: float = _opt(
        DEFAULT_CARRIER_TIMEOUT_S,
        "seconds",
        "deadline of SAVE_ALLOCATIONS / LOAD_ALLOCATIONS (the shared bytes to and from the "
        "chunk files); a stopped participant fails it after --phase-timeout-s "
        f"[default: {DEFAULT_CARRIER_TIMEOUT_S:g}].",
    )
    criu_timeout_s: float = _opt(
        3600.0,
        "seconds",
        "deadline of one CRIU run: past it CRIU is killed and the step fails "
        "[default: 3600, or $CUINTERPOSE_CRIU_TIMEOUT_S].",
        env="CUINTERPOSE_CRIU_TIMEOUT_S",
    )
    local_dir: Optional[str] = _opt(
        None,
        "path",
        "with an s3:// images dir: the local copy, the directory a checkpoint writes before its "
        "upload or a restore downloads into (missing or empty) [default: "
        "/var/lib/cuinterpose/staging/checkpoint/BUCKET/PREFIX, or restore/BUCKET/PREFIX.<8 "
        "hex>; a daemon: under its --staging-dir, where a request's must lie].",
        pod=False,
        optional=True,
    )
    keep_local: bool = _opt(
        False,
        "flag",
        "with an s3:// images dir: keep the local copy once the upload committed or the restore "
        "ended (a failed upload always keeps it) [default: off].",
        pod=False,
    )
    staging_bytes: Optional[int] = _opt(
        None,
        "bytes",
        "staging memory per process (the shims' chunk writers) and per GPU stream (custom "
        "storage), at least the chunk size, in bytes or with KiB/MiB/GiB "
        f"[default: {DEFAULT_STAGING_BYTES >> 20} MiB, for the shims and per stream alike, or "
        "$CUINTERPOSE_STAGING_BYTES].",
        env="CUINTERPOSE_STAGING_BYTES",
    )


@dataclasses.dataclass(frozen=True)
class CheckpointOptions(RunOptions):
    """Every option of a checkpoint (agent/run/checkpoint.py ``Checkpoint``)."""

    control_dir: str = _control_dir()
    quiesce_timeout_ms: int = _opt(
        10_000, "ms", "how long the workload may take to park [default: 10000]."
    )
    lock_timeout_ms: int = _opt(
        10_000,
        "ms",
        "cuCheckpointProcessLock timeout per process (0: the driver-call deadline) "
        "[default: 10000].",
        lo=0,
    )
    leave_running: bool = _opt(
        False, "flag", "keep the workload running after the snapshot [default: off]."
    )
    gpu_storage: str = _opt(
        "auto",
        "choice",
        "where native checkpoint puts each process's GPU memory: custom (the driver's custom "
        "storage, CUDA 13.4+: streamed to chunks/gpu-<pid>-<ordinal>.bin, outside CRIU's "
        "images), host (staged in the process's host memory, which CRIU dumps), or auto "
        "(custom where the driver has it) [default: $CUINTERPOSE_GPU_STORAGE, else auto].",
        env="CUINTERPOSE_GPU_STORAGE",
        choices=GPU_STORAGE_MODES,
    )
    chunk_bytes: Optional[int] = _opt(
        None,
        "bytes",
        "chunk size of the chunk files, a power of two from 64 KiB to 1 GiB, in bytes or with "
        f"KiB/MiB/GiB [default: {DEFAULT_CHUNK_BYTES >> 20} MiB, or $CUINTERPOSE_CHUNK_BYTES].",
        env="CUINTERPOSE_CHUNK_BYTES",
    )
    writers: Optional[int] = _opt(
        None,
        "count",
        f"chunk writer threads per process, 1 to 64 [default: {DEFAULT_WRITERS}, or "
        "$CUINTERPOSE_WRITERS].",
        env="CUINTERPOSE_WRITERS",
        hi=64,
    )
    chunk_checksum: Optional[str] = _opt(
        None,
        "choice",
        "the chunk checksum: sha256 or blake2b-256 [default: $CUINTERPOSE_CHUNK_CHECKSUM, else "
        "the one this node's CPU computes fastest].",
        env="CUINTERPOSE_CHUNK_CHECKSUM",
        choices=(None, *sorted(CHUNK_CHECKSUMS)),
    )
    incremental: bool = _opt(
        False,
        "flag",
        "write the shared carriers into the chunk store of the snapshot root (the images "
        "dir's parent): only chunks no snapshot there holds yet [default: off, or "
        "$CUINTERPOSE_INCREMENTAL=1].",
        env="CUINTERPOSE_INCREMENTAL",
    )

    @classmethod
    def _check_together(cls, values: dict, labels: dict) -> None:
        """The chunk settings (the shims' and the GPU streams' one ``ChunkSettings``) against
        protocol.h's limits (defaults filled in), and ``gpu_storage`` custom against a
        ``native_backend`` without custom storage (the cuda-checkpoint utility stages in host
        memory): refused here, before any step."""
        if values["gpu_storage"] == "custom" and values["native_backend"] == "cuda-checkpoint":
            raise OptionError(
                "gpu_storage",
                "custom",
                f"the cuda-checkpoint backend ({labels.get('native_backend', 'native_backend')}"
                "='cuda-checkpoint') has no custom storage (host staging); use host (or auto), "
                "or the driver-api (or auto) native backend",
                labels.get("gpu_storage"),
            )
        given = {k: values[k] for k in ("chunk_bytes", "staging_bytes", "writers") if values[k]}
        names = {
            k: labels.get(k, k) + ("" if values[k] else " (the default)")
            for k in ("chunk_bytes", "staging_bytes", "writers")
        }
        try:
            ChunkSettings.of(names, **given)
        except ValueError as e:
            raise AgentError("request", str(e)) from None

    def chunk_settings(self) -> dict:
        """The chunk settings given (``chunk_bytes``, ``staging_bytes``, ``writers``,
        ``checksum``), without those left to the default (agent/run/carriers.py
        ``settings``)."""
        out = {
            "chunk_bytes": self.chunk_bytes,
            "staging_bytes": self.staging_bytes,
            "writers": self.writers,
            "checksum": self.chunk_checksum,
        }
        return {k: v for k, v in out.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class RestoreOptions(RunOptions):
    """Every option of a restore (agent/run/restore.py ``Restore``). What it restores into
    (``--into-pid``, ``--device-map``) is the request's, not an option."""


#: the options classes by request kind
BY_KIND: dict[str, type] = {
    "checkpoint": CheckpointOptions,
    "restore": RestoreOptions,
    "inspect": InspectOptions,
}


def annotated_fields(cls) -> tuple:
    """The fields of ``cls`` a pod annotation may set."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata["spec"].pod)


def given_of(cls, kw: Mapping[str, Any]) -> dict:
    """The options ``kw`` (e.g. a command's parameters) sets: its keys that are fields of
    ``cls`` with a value that is not None."""
    return {n: kw[n] for n in cls.names() if kw.get(n) is not None}


def for_kinds(
    values: Optional[Mapping[str, Any]] = None,
    environ: Optional[Mapping[str, str]] = None,
    label: Optional[Callable[[str], str]] = None,
) -> dict:
    """One options object per request kind (:data:`BY_KIND`): ``environ`` (default: none, the
    defaults; a daemon passes ``os.environ``) with ``values`` (option name -> typed value, None
    skipped: a daemon's config and flags) over it, each class taking the names it has. Raises
    :class:`OptionError` (``label(name)`` spells a value of ``values``)."""
    given = {k: v for k, v in (values or {}).items() if v is not None}
    return {
        kind: cls.from_environ(
            {} if environ is None else environ,
            {n: v for n, v in given.items() if n in cls.names()},
            label,
        )
        for kind, cls in BY_KIND.items()
    }
